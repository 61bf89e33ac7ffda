"""Put code/ and code/lecture27/ on sys.path, as the scripts do for themselves."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT / "code", ROOT / "code" / "lecture27"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
