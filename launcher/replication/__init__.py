"""Cross-host replication: where each host's checkpoint is copied (``placement``), how the
bytes move between supervisors (``transport``), and the supervisor service that drives
both (``service``)."""
