import os
import sys

# Tests import the packages from the checkout even when it is not installed, and import
# `bruteforce` as a plain module.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
