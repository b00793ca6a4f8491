# TEMPORARY during the layout move: the module is moved here once its current edit lands.
from verl_dppo.topk import *  # noqa: F401,F403
from verl_dppo.topk import DEFAULT_CHUNK_BYTES, MASS_TOLERANCE, TopKInputError, divergence_at_slots  # noqa: F401
