"""Put code/ and code/lecture27/ on sys.path, as the scripts do for themselves.

L27_SEED=S python -m pytest -q tests  runs the whole suite against the small models trained with seed S
(the record-world model and the city LLaMA): every bound a test puts on a trained model's figure must
hold for any model the training recipe produces, not only for the one on this disk."""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT / "code", ROOT / "code" / "lecture27"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

if os.environ.get("L27_SEED"):
    import blend_world
    from common import city

    blend_world.SEED = city.SEED = int(os.environ["L27_SEED"])
