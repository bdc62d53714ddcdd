import os
import sys

here = os.path.dirname(__file__)
sys.path.insert(0, here)  # for `import inspect_models`
sys.path.insert(0, os.path.join(here, "..", "observe"))  # for `import dense_meters`
