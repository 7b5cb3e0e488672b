"""`jaxppo.tune`: Ray Tune drives jaxppo. The code lives in `jaxppo.search.tune`."""

from jaxppo.search.tune import trainable, trial_config

__all__ = ["trainable", "trial_config"]
