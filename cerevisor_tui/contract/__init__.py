"""The typed contract between a run and its consoles: the events a run tells, the commands it takes, the
control socket's messages, and the rules both sides compute alike. Both the run and the console import it;
it imports nothing of either."""
