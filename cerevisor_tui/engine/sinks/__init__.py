"""The run's sinks: subscribers that keep what the event stream says (the run directory's journal and
transcripts, `report.json`, the headless printer's lines)."""
