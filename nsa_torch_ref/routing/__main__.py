"""`python -m nsa_torch_ref.routing`: the routing summary as JSON."""
import sys

from nsa_torch_ref.routing import main

sys.exit(main())
