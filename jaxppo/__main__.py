from jaxppo.cli import main

raise SystemExit(main())
