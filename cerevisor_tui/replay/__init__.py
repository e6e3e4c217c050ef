"""Agentic replay: session files generated from the published studies' models or imported from published
traces (one JSON line per turn), their statistics, and their closed-loop replay against a server. Nothing of the
engine or the console."""
