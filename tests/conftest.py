import os

# Every pass verifies its invariants in tests (docs/architecture.md, "The pass lists").
os.environ.setdefault("PARTC_VERIFY", "1")
