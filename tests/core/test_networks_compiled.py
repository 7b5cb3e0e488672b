"""Network tests whose verdict is what XLA's CPU backend makes of a program compiled as users'
runs are (the whole file compiles with full optimisation, tests/conftest.py): the max-pool
gradient's working memory, and two programs compared to the last bit. Apart from the other
network tests (tests/core/test_networks.py, optimisation off), so that a worker switches the
setting, and drops what it compiled under the other one, once for the three."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxppo
from jaxppo.core import ppo
from jaxppo.core.algorithm import Algorithm
from jaxppo.core.hyperparams import HyperParams
from test_networks import PENDULUM, _flax_max_pool

pytestmark = pytest.mark.full_optimization


def test_max_pool_gradient_makes_no_scatter():
    """JAX's max-pool gradient is a select-and-scatter, which XLA's CPU backend expands into
    index arrays and a scatter the size of the padded input; max_pool's makes neither, and
    compiles to a fraction of that working memory."""
    import re

    from jaxppo.core.networks import max_pool

    x = jnp.zeros((4, 42, 42, 16))

    def compiled(pool):
        return jax.jit(jax.grad(lambda x: jnp.sum(pool(x) ** 2))).lower(x).compile()

    ours, theirs = compiled(max_pool), compiled(_flax_max_pool)
    scatter = re.compile(r"\sscatter\(")  # the HLO op (metadata may name a scatter too)
    assert scatter.search(theirs.as_text())  # what the rule avoids, there in JAX's own
    assert not scatter.search(ours.as_text())
    temp = lambda c: c.memory_analysis().temp_size_in_bytes  # noqa: E731
    assert temp(ours) < temp(theirs) / 3, (temp(ours), temp(theirs))


@pytest.mark.parametrize("recurrent", [False, True], ids=["feed-forward", "gru"])
def test_learning_from_raw_observations_is_learning_from_normalised_ones(recurrent):
    """The update keeps the batch's observations raw (in the env's dtype: uint8 frames stay
    a quarter of their float32 size) and makes each minibatch's the network's input with the
    acting statistics: the same params, optimiser state and loss terms, bit for bit, as
    learning from the batch normalised up front."""
    net = jaxppo.NetworkConfig((16,), recurrent_size=8 if recurrent else 0)
    cfg = PENDULUM.replace(normalize_observations=True, network=net)
    algo = Algorithm.create(jaxppo.resolve(cfg))
    hp = HyperParams.from_config(cfg)
    state = jax.jit(ppo.init, static_argnums=0)(algo, jax.random.PRNGKey(0), hp)
    rolled, traj = jax.jit(ppo.rollout, static_argnums=0)(algo, state, hp)
    stats = rolled.obs_stats  # from the first observations: not the identity
    values, _ = ppo.rollout_values(algo, rolled.params, stats, traj)
    raw = ppo.make_batch(algo, stats, traj, values, -values, values, raw_obs=True)
    assert raw.obs is traj.obs

    # Both in one program each, as in the update (XLA computes the normalisation alike there).
    @functools.partial(jax.jit, static_argnums=0)
    def learn(raw_obs):
        batch = ppo.make_batch(algo, stats, traj, values, -values, values, raw_obs=raw_obs)
        return ppo.learn(algo, rolled.params, rolled.opt_state, batch, rolled.env_ids,
                         jax.random.PRNGKey(1), hp, 1e-3, 0.01, 0.2,
                         stats if raw_obs else None)

    ours, theirs = learn(True), learn(False)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
