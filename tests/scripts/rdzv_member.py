"""A rendezvous member that dies right after its round forms, before it posts its part.

usage: rdzv_member.py ENDPOINT RUN_ID
Joins the c10d rendezvous at ENDPOINT (as a client of a store hosted elsewhere) and
waits for a round of two nodes; prints "joined round" once the round has formed, then
SIGKILLs itself, as a host lost at that moment would be. It encodes the rendezvous
state as gemini's hosts do (JSON, unsigned: the run has no secret file).
"""

import os
import signal
import sys

from torch.distributed.elastic.rendezvous import RendezvousParameters, registry

from launcher import rendezvous_state

rendezvous_state.install()

endpoint, run_id = sys.argv[1], sys.argv[2]
params = RendezvousParameters(backend="c10d", endpoint=endpoint, run_id=run_id, min_nodes=2,
                              max_nodes=2, is_host="false", keep_alive_interval="1",
                              keep_alive_max_attempt="2")
handler = registry.get_rendezvous_handler(params)
print("waiting", flush=True)
handler.next_rendezvous()
print("joined round", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
