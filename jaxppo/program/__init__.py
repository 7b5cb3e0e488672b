"""Where and how a run runs: its config resolved once (`resolve` -> `Resolved`, on a `Layout`
of devices and hosts), the compiled program built for that layout (`build_program`), the
state moved between the device layout and the unsharded one (`shards`), and whether the
program fits in memory (`memory`).
"""

from jaxppo.program.build import build_program
from jaxppo.program.layout import Layout
from jaxppo.program.resolved import Resolved, resolve

__all__ = ["build_program", "resolve", "Resolved", "Layout"]
