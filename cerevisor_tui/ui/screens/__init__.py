"""The console's screens: main, settings, help, and the confirm dialog."""
