"""`python -m nsa_torch_ref.fast`: the routing summary as JSON (`routing.main`)."""
import sys

from nsa_torch_ref.fast.routing import main

sys.exit(main())
