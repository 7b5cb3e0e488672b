# `python -m jaxppo` imports what the console script `jaxppo` imports: not from the folder
# it runs in (jaxppo.envs.imports says where a user's own modules are looked up).
from jaxppo.envs.imports import leave_out_cwd

leave_out_cwd()

from jaxppo.cli import main  # noqa: E402

raise SystemExit(main())
