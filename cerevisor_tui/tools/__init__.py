"""MCP tools for agents: the run's tool servers (`manager`), who may call what (`permissions`), and the
shapes tools and their results take between MCP and the model (`schemas`)."""
