import sys

from partc.cli.main import main

sys.exit(main())
