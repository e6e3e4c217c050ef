"""A run as a process of its own: its control socket (server.py), the clients that attach to it
(client.py), the wire format they share (protocol.py) and the run directories they find (runs.py)."""
