"""Videos of a trained policy's episodes (`jaxppo eval RUN_DIR --video out.gif`): played on
the host with the jitted policy and drawn with matplotlib, for gymnax's classic-control envs
and MinAtar (from the observations), JaxMARL's MPE, SMAX and Overcooked (from the env's state,
every agent acting with the joint policy), and the envs that step in Python, gymnasium's and
envpool's (the pictures the env renders itself, render_mode='rgb_array'). A .gif needs
nothing more; an .mp4 needs ffmpeg (on the PATH or from imageio-ffmpeg,
`pip install 'jaxppo[video]'`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

from jaxppo.errors import VideoError
from jaxppo.run.policy import Policy

VIDEO_INSTALL = "pip install 'jaxppo[video]'"
CLASSIC_CONTROL = ("Acrobot-v1", "CartPole-v1", "MountainCar-v0", "MountainCarContinuous-v0",
                   "Pendulum-v1")
FORMATS = (".gif", ".mp4")
MULTI_AGENT = ("JaxMARL's MPE envs (jaxmarl:MPE_*), SMAX (jaxmarl:smax:<map>) and Overcooked "
               "(jaxmarl:overcooked:<layout>)")
ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"  # an MPE speaker's message, as JaxMARL shows it
OVERCOOKED_TILE = 32  # pixels per grid cell


class Episode(NamedTuple):
    """One recorded episode: observations [T + 1, *obs_shape] (the first from reset, the last
    the one the episode ended in; a multi-agent env's [T + 1, agents, obs_dim]; an env that
    steps in Python, the pictures it rendered [T, H, W, 3], from the reset to the step before
    the last, within which the env restarts), rewards [T] (a multi-agent env's team reward,
    the sum over its agents) and, for a multi-agent env, JaxMARL's states [T + 1] (host
    arrays) that its frames are drawn from; else None."""

    observations: np.ndarray
    rewards: np.ndarray
    states: list | None = None

    @property
    def length(self) -> int:
        return len(self.rewards)

    @property
    def frames(self) -> list | np.ndarray:
        """What each frame draws: the states of a multi-agent env, else the observations."""
        return self.observations if self.states is None else self.states


def write_video(policy: Policy, path: str | Path, *, episodes: int = 1, seed: int = 0,
                deterministic: bool = True, max_steps: int | None = None,
                fps: int | None = None) -> dict:
    """Plays episodes of a policy and writes them, one after the other, to a video.

    Args:
      policy: the trained policy.
      path: the video, .gif or .mp4; one frame per observation.
      episodes: how many episodes.
      seed: the key of the first reset and of sampled actions.
      deterministic: act with the distribution's mode (else sample).
      max_steps: caps each episode (default: the env's time limit).
      fps: frames per second (default 20 for classic control, 10 for MinAtar).

    Returns:
      {"path", "frames", "episodes", "returns", "lengths"}: each episode's return (a
      multi-agent env's team return) and length.

    Raises:
      VideoError: before playing anything, for an env it cannot draw or a format it
        cannot write.
      ValueError: episodes or max_steps is not an integer >= 1.
    """
    if not isinstance(episodes, int) or isinstance(episodes, bool) or episodes < 1:
        raise ValueError(f"episodes={episodes!r} must be an integer >= 1")
    path = Path(path)
    name, draw = renderer(policy)
    host = policy.spec.host_loop
    writer = _writer(path, fps or (20 if name in CLASSIC_CONTROL or host else 10))
    played = record_episodes(policy, episodes=episodes, seed=seed, deterministic=deterministic,
                             max_steps=max_steps)
    frames = _animate(played, draw, name, writer, path)
    return {"path": str(path), "frames": frames, "episodes": episodes,
            "returns": [float(e.rewards.sum()) for e in played],
            "lengths": [e.length for e in played]}


def record_episodes(policy: Policy, *, episodes: int = 1, seed: int = 0,
                    deterministic: bool = True, max_steps: int | None = None) -> list[Episode]:
    """Plays episodes one after the other on the host, one env step at a time.

    Args:
      policy: the trained policy.
      episodes: how many episodes.
      seed: keys come from PRNGKey(seed).
      deterministic: act with the distribution's mode (else sample).
      max_steps: caps each episode (default: the env's time limit).

    Returns:
      One `Episode` each, until it terminated or truncated or reached max_steps. A masked
      policy acts among the legal actions of each state (the env's action mask). In a
      multi-agent env every agent acts with the joint policy (its observations [agents,
      obs_dim] one batch, a recurrent policy's carry one per agent).

    Raises:
      ValueError: max_steps is not an integer >= 1.
    """
    if max_steps is not None and (not isinstance(max_steps, int) or isinstance(max_steps, bool)
                                  or max_steps < 1):
        raise ValueError(f"max_steps={max_steps!r} must be an integer >= 1 (or None for the "
                         "env's time limit)")
    bound = max_steps if max_steps is not None else policy.algorithm.eval_bound()
    if policy.spec.host_loop:
        return _record_host_episodes(policy, episodes, seed, deterministic, bound)
    params, agents = policy.spec.eval_params, policy.agents  # as evaluation plays it
    reset, step = policy.jitted_env
    key = jax.random.PRNGKey(seed)
    out = []
    for _ in range(episodes):
        key, k_reset = jax.random.split(key)
        obs, state = reset(k_reset, params)
        carry = policy.initial_carry((len(agents),) if agents else ())
        observations, rewards = [np.asarray(obs)], []
        states = [jax.device_get(_marl_state(state))] if agents else None
        for _ in range(bound):
            key, k_act, k_step = jax.random.split(key, 3)
            mask = policy.action_mask(state) if policy.masked else None
            action, carry = policy.step(obs, carry, None if deterministic else k_act, mask)
            obs, state, reward, terminated, truncated, info = step(k_step, state, action, params)
            rewards.append(float(np.sum(reward)))  # a multi-agent env's: the team's
            # The observation (and state) the step reached, before an auto-reset replaced it.
            observations.append(np.asarray(info["final_observation"]))
            if agents:
                states.append(jax.device_get(info["final_state"]))
            if bool(terminated) or bool(truncated):
                break
        out.append(Episode(np.stack(observations), np.asarray(rewards, np.float32), states))
    return out


def _record_host_episodes(policy: Policy, episodes: int, seed: int, deterministic: bool,
                          bound: int) -> list[Episode]:
    """`record_episodes` for an env that steps in Python (gymnasium, envpool): one env made
    with render_mode='rgb_array' plays each episode as evaluation does (Atari: a whole game,
    its game score), episode i the one `policy.evaluate(episodes=1, seed=seed + i)` plays;
    its pictures are the frames."""
    from jaxppo.run.hostloop import play_episodes

    envs = policy.env.make_vec(1, render=True)
    out = []
    try:
        for i in range(episodes):
            k_play = jax.random.PRNGKey(seed + i)
            pictures, rewards = [], []

            def watch(reward, going):
                if reward is not None:
                    rewards.append(reward)
                if going:
                    pictures.append(_picture(envs, policy.config.env))

            play_episodes(policy.algorithm, policy.params, policy.obs_stats, k_play, envs,
                          bound, deterministic, watch)
            out.append(Episode(np.stack(pictures), np.asarray(rewards, np.float32)))
    finally:
        envs.close()
    return out


def _picture(envs, env_name: str) -> np.ndarray:
    """Env 0's picture [H, W, 3] (VideoError when the env cannot render, e.g. gymnasium's
    classic control without pygame)."""
    try:
        picture = np.asarray(envs.render()[0])
    except Exception as e:  # noqa: BLE001 - the env's own renderer failed: say which and why
        hint = ("; MuJoCo draws without a display through EGL: run with MUJOCO_GL=egl set"
                if "OpenGL" in str(e) and not os.environ.get("MUJOCO_GL") else "")
        raise VideoError(f"no video for {env_name}: the env cannot render a picture "
                         f"(render_mode='rgb_array': {type(e).__name__}: {str(e)[:200]})"
                         f"{hint}") from None
    if picture.ndim != 3 or picture.shape[-1] not in (3, 4):
        raise VideoError(f"no video for {env_name}: with render_mode='rgb_array' its render() "
                         f"gave {picture.shape if picture.ndim else picture.item()!r}, not a "
                         "picture [H, W, 3]")
    return picture


def _marl_state(state):
    """JaxMARL's state inside a multi-agent env's state (under its transforms' states)."""
    while not hasattr(state, "marl_state"):
        state = state.env_state
    return state.marl_state


# ---------------------------------------------------------------- drawing
# Drawn here, not with gymnax.visualize: that needs pygame and a gymnasium env per frame.
def renderer(policy: Policy) -> tuple[str, Callable]:
    """How to draw the policy's env.

    Returns:
      (env name, setup(ax) -> update(obs)).

    Raises:
      VideoError: an env jaxppo does not draw (only classic control, MinAtar, JaxMARL's MPE, SMAX
        and Overcooked, and the envs that step in Python, which draw themselves).
    """
    if policy.agents:
        return _multi_agent_renderer(policy)
    if policy.spec.host_loop:  # the env's own pictures
        def show(ax):
            shown = []

            def update(picture):
                if shown:
                    shown[0].set_data(picture)
                else:
                    shown.append(ax.imshow(picture))
            return update
        return policy.config.env_name, show
    base = policy.env
    while hasattr(base, "_env"):  # jaxppo's observation/action wrappers (transforms)
        base = base._env
    name = getattr(base, "name", None)
    base_shape = tuple(base.observation_space(policy.env_params).shape)
    newest = _newest_frame(base_shape, policy.spec.obs_shape)
    if name in CLASSIC_CONTROL:
        draw = _CLASSIC[name]
    elif isinstance(name, str) and name.endswith("-MinAtar") and len(base_shape) == 3:
        draw = lambda ax, params: _minatar(ax, base_shape[-1])  # noqa: E731
    else:
        draw = None
    if draw is not None:
        def setup(ax):
            update = draw(ax, policy.env_params)
            return lambda obs: update(newest(obs))
        return name, setup
    raise VideoError(
        f"no video for {policy.config.env_name}: jaxppo draws gymnax's classic-control envs "
        f"({', '.join(CLASSIC_CONTROL)}), the MinAtar envs (*-MinAtar) and, of the "
        f"multi-agent envs, {MULTI_AGENT}; gymnasium and envpool envs draw themselves. "
        "`jaxppo eval` without --video evaluates any env")


def _multi_agent_renderer(policy: Policy) -> tuple[str, Callable]:
    """(env name, setup(ax) -> update(JaxMARL state)) for a multi-agent env (VideoError for
    one jaxppo does not draw)."""
    marl = getattr(policy.env, "marl_env", None)
    module = type(marl).__module__
    if module.startswith("jaxmarl.environments.mpe."):
        return policy.config.env_name, lambda ax: _mpe(ax, marl)
    if module.startswith("jaxmarl.environments.overcooked."):
        return policy.config.env_name, lambda ax: _overcooked(ax, marl)
    if module.startswith("jaxmarl.environments.smax."):
        return policy.config.env_name, lambda ax: _smax(ax, getattr(marl, "_env", marl))
    raise VideoError(
        f"no video for {policy.config.env}: of the multi-agent envs jaxppo draws {MULTI_AGENT}. "
        "`jaxppo eval` without --video evaluates any env")


def _newest_frame(base_shape: tuple, obs_shape: tuple) -> Callable:
    """obs -> the env's own observation: the newest frame of a `frame_stack` stack."""
    obs_shape = tuple(obs_shape)
    if obs_shape == base_shape:
        return lambda obs: obs
    if len(base_shape) == 3:  # images stack on the channel axis
        return lambda obs: obs[..., -base_shape[-1]:]
    return lambda obs: obs[..., -1]


def _param(params, name: str, default: float) -> float:
    return float(getattr(params, name, default))


def _cartpole(ax, params):
    edge = _param(params, "x_threshold", 2.4)
    pole = 2.0 * _param(params, "length", 0.5)
    ax.set(xlim=(-edge * 1.1, edge * 1.1), ylim=(-0.6, pole + 0.3))
    ax.axhline(0.0, color="0.4", lw=1)
    cart = ax.add_patch(_rectangle((0, 0), 0.5, 0.3, color="tab:blue"))
    (rod,) = ax.plot([], [], lw=5, color="tab:orange", solid_capstyle="round")

    def update(obs):
        x, theta = float(obs[0]), float(obs[2])
        cart.set_xy((x - 0.25, -0.15))
        rod.set_data([x, x + pole * np.sin(theta)], [0.15, 0.15 + pole * np.cos(theta)])
    return update


def _pendulum(ax, params):
    ax.set(xlim=(-1.3, 1.3), ylim=(-1.3, 1.3))
    (rod,) = ax.plot([], [], lw=8, color="tab:red", solid_capstyle="round")
    ax.plot([0], [0], "o", color="k")

    def update(obs):
        cos, sin = float(obs[0]), float(obs[1])  # theta = 0 is upright
        rod.set_data([0, -sin], [0, cos])
    return update


def _acrobot(ax, params):
    ax.set(xlim=(-2.2, 2.2), ylim=(-2.2, 2.2))
    ax.axhline(1.0, color="0.4", lw=1, ls="--")  # the height to reach
    (links,) = ax.plot([], [], "-o", lw=5, color="tab:blue", markersize=6, markerfacecolor="k")

    def update(obs):
        c1, s1, c2, s2 = (float(v) for v in obs[:4])  # theta1 = 0 hangs down
        x1, y1 = s1, -c1
        x2, y2 = x1 + s1 * c2 + c1 * s2, y1 - (c1 * c2 - s1 * s2)
        links.set_data([0, x1, x2], [0, y1, y2])
    return update


def _mountain_car(ax, params):
    lo, hi = _param(params, "min_position", -1.2), _param(params, "max_position", 0.6)
    goal = _param(params, "goal_position", 0.5)
    height = lambda x: np.sin(3 * x) * 0.45 + 0.55  # noqa: E731 (gymnasium's hill)
    xs = np.linspace(lo, hi, 200)
    ax.set(xlim=(lo, hi), ylim=(0, 1.2))
    ax.plot(xs, height(xs), color="0.3")
    ax.plot([goal, goal], [height(goal), height(goal) + 0.15], color="tab:green", lw=2)
    (car,) = ax.plot([], [], "o", markersize=12, color="tab:blue")

    def update(obs):
        x = float(obs[0])
        car.set_data([x], [height(x) + 0.03])
    return update


_CLASSIC = {"CartPole-v1": _cartpole, "Pendulum-v1": _pendulum, "Acrobot-v1": _acrobot,
            "MountainCar-v0": _mountain_car, "MountainCarContinuous-v0": _mountain_car}


def _minatar(ax, channels: int):
    """Each cell coloured by the last channel set there (black when none)."""
    import matplotlib
    from matplotlib.colors import ListedColormap

    colours = [(0, 0, 0)] + [matplotlib.colormaps["tab10"](i % 10)[:3] for i in range(channels)]
    image = ax.imshow(np.zeros((10, 10)), cmap=ListedColormap(colours), vmin=0, vmax=channels,
                      interpolation="none")
    codes = np.arange(1, channels + 1)

    def update(obs):
        image.set_data(np.max(np.asarray(obs, np.float32) * codes, axis=-1))
    return update


def _mpe(ax, marl):
    """An MPE state as JaxMARL's MPEVisualizer draws it: each entity (agents, then landmarks)
    a circle of its radius and colour at its position in [-2, 2]^2, and what each agent that
    speaks says."""
    from matplotlib.patches import Circle

    ax.set(xlim=(-2, 2), ylim=(-2, 2))
    colours, radii = np.asarray(marl.colour, np.float32) / 255, np.asarray(marl.rad)
    circles = [ax.add_patch(Circle((0.0, 0.0), radii[i], color=colours[i]))
               for i in range(marl.num_entities)]
    speakers = np.flatnonzero(np.asarray(marl.silent) == 0)
    said = [ax.text(-1.95, -1.95 + 0.17 * j, "", fontsize=7) for j in range(len(speakers))]

    def update(state):
        for circle, pos in zip(circles, np.asarray(state.p_pos)):
            circle.center = pos
        for text, i in zip(said, speakers):
            text.set_text(f"{marl.agents[i]} says {ALPHABET[int(np.argmax(state.c[i]))]}")
    return update


def _overcooked(ax, marl):
    """An Overcooked state as JaxMARL's OvercookedVisualizer renders it (rgb, no display):
    the kitchen's tiles, pots, onions, plates and soups, and each agent, its direction and
    what it holds."""
    from jaxppo.envs.jaxmarl_suite import import_jaxmarl

    visualizer = import_jaxmarl("jaxmarl.viz.overcooked_visualizer").OvercookedVisualizer
    pad = marl.agent_view_size - 2  # the border JaxMARL's own animation leaves out

    def rgb(state):
        grid = np.asarray(state.maze_map)[pad:-pad, pad:-pad, :]
        return visualizer._render_grid(grid, tile_size=OVERCOOKED_TILE,
                                       agent_dir_idx=np.asarray(state.agent_dir_idx),
                                       agent_inv=np.asarray(state.agent_inv))

    image = None

    def update(state):
        nonlocal image
        if image is None:
            image = ax.imshow(rgb(state), interpolation="none")
        else:
            image.set_data(rgb(state))
    return update


def _smax(ax, smax):
    """A SMAX state (each env step's, not the world steps within it) in the colours of
    JaxMARL's SMAX renderer: each unit alive a circle of its type's radius at its position,
    allies blue and enemies green, its type's shorthand in it and fading as it loses health,
    and a grey line from each unit that attacked in the step to the unit it attacked."""
    from matplotlib.patches import Circle

    ax.set(xlim=(0, smax.map_width), ylim=(0, smax.map_height))
    allies, n = smax.num_allies, smax.num_agents
    radii, full = np.asarray(smax.unit_type_radiuses), np.asarray(smax.unit_type_health)
    circles = [ax.add_patch(Circle((0.0, 0.0), 1.0, color="blue" if i < allies else "green"))
               for i in range(n)]
    labels = [ax.text(0.0, 0.0, "", fontsize=6, color="white", ha="center", va="center")
              for _ in range(n)]
    shots = [ax.plot([], [], color="grey", lw=0.8)[0] for _ in range(n)]

    def update(state):
        state = state if hasattr(state, "unit_positions") else state.state
        pos, alive = np.asarray(state.unit_positions), np.asarray(state.unit_alive)
        kind, health = np.asarray(state.unit_types), np.asarray(state.unit_health)
        attacked = np.asarray(state.prev_attack_actions) - smax.num_movement_actions
        for i in range(n):
            circles[i].set(visible=bool(alive[i]), center=pos[i], radius=radii[kind[i]],
                           alpha=0.35 + 0.65 * float(np.clip(health[i] / full[kind[i]], 0, 1)))
            shorthand = smax.unit_type_shorthands[kind[i]] if alive[i] else ""
            labels[i].set(position=pos[i], text=shorthand)
            # JaxMARL's attack actions: an ally's a-th enemy, an enemy's a-th ally from the last
            target = allies + attacked[i] if i < allies else allies - 1 - attacked[i]
            hit = alive[i] and attacked[i] >= 0 and 0 <= target < n
            shots[i].set_data(*([pos[i][0], pos[target][0]], [pos[i][1], pos[target][1]])
                              if hit else ([], []))
    return update


def _rectangle(xy, w, h, **kw):
    from matplotlib.patches import Rectangle

    return Rectangle(xy, w, h, **kw)


# ---------------------------------------------------------------- writing
def _writer(path: Path, fps: int):
    """The matplotlib animation writer for path's suffix, or VideoError before any work."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import animation

    suffix = path.suffix.lower()
    if suffix == ".gif":
        return animation.PillowWriter(fps=fps)
    if suffix != ".mp4":
        raise VideoError(f"cannot write a video to {path}: use a .gif (needs nothing more) "
                         "or an .mp4 (needs ffmpeg)")
    if not (shutil.which(matplotlib.rcParams["animation.ffmpeg_path"]) or shutil.which("ffmpeg")):
        try:
            import imageio_ffmpeg
        except ImportError as e:
            raise VideoError(f"writing {path.name} needs ffmpeg, which is not installed: "
                             f"{VIDEO_INSTALL} (imageio-ffmpeg brings it), or install ffmpeg; "
                             "or write a .gif, which needs nothing more") from e
        matplotlib.rcParams["animation.ffmpeg_path"] = imageio_ffmpeg.get_ffmpeg_exe()
    elif not shutil.which(matplotlib.rcParams["animation.ffmpeg_path"]):
        matplotlib.rcParams["animation.ffmpeg_path"] = shutil.which("ffmpeg")
    return animation.FFMpegWriter(fps=fps, codec="libx264", extra_args=["-pix_fmt", "yuv420p"])


def _animate(played: list[Episode], setup: Callable, name: str, writer, path: Path) -> int:
    """Draw every observation of every episode as one frame; returns the frame count."""
    import matplotlib.pyplot as plt
    from matplotlib import animation

    frames = [(e, t) for e in range(len(played)) for t in range(len(played[e].frames))]
    fig, ax = plt.subplots(figsize=(4, 3.4), dpi=80, layout="constrained")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_aspect("equal")
    update = setup(ax)
    returns = [np.concatenate([[0.0], np.cumsum(e.rewards)]) for e in played]
    word = "return" if played[0].states is None else "team return"

    def draw(i):
        e, t = frames[i]
        update(played[e].frames[t])
        ax.set_title(f"{name}  episode {e + 1}/{len(played)}  step {t}  {word} "
                     f"{returns[e][t]:.1f}", fontsize=8)

    try:
        anim = animation.FuncAnimation(fig, draw, frames=len(frames), repeat=False)
        path.parent.mkdir(parents=True, exist_ok=True)
        anim.save(path, writer=writer)
    finally:
        plt.close(fig)
    return len(frames)
