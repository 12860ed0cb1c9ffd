"""The fresh processes the benchmark measures in: `python -m sdxl.bench FUNCTION OPTIONS_JSON`."""

import json
import sys

from .loading import load, read_into_fresh_memory
from .speed import probe

FUNCTIONS = {"probe": probe, "load": load, "read_into_fresh_memory": read_into_fresh_memory}

if __name__ == "__main__":
    print(json.dumps(FUNCTIONS[sys.argv[1]](**json.loads(sys.argv[2]))))
