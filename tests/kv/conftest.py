import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # for `import eager_reference`
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "hf"))  # for `import tiny_models`
