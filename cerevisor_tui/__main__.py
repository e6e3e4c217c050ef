"""`python -m cerevisor_tui` runs the same CLI as the `cerevisor-tui` script."""

from cerevisor_tui.cli import main

raise SystemExit(main())
