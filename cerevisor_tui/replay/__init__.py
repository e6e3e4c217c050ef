"""Agentic replay: session files generated from the published studies' models or imported from published
traces (one JSON line per turn), and their statistics. Plain Python: nothing of the engine or the console."""
