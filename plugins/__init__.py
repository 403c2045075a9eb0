"""Built-in plugins, each registered under a fixed entry-point name."""
