import os
import sys

here = os.path.dirname(__file__)
sys.path.insert(0, here)  # for `import steer_reference`
sys.path.insert(0, os.path.join(os.path.dirname(here), "hf"))  # `import tiny_models`
sys.path.insert(0, os.path.join(os.path.dirname(here), "probes"))  # `import wordlevel`
