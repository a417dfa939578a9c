"""Makes the unit tests import the SDK of this working tree (``sdk/python/dsec``), not an
installed copy, and the test server helper next to them."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
for p in (HERE, os.path.dirname(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)
