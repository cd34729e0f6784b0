import os

# Every pass verifies its invariants in tests (STYLE.md habit 4).
os.environ.setdefault("PARTC_VERIFY", "1")
