"""torchrun on one machine with every socket it opens on loopback.

Stock torchrun's c10d rendezvous listens on every interface: ``TCPStore`` ignores its host
argument when it starts a server and binds the wildcard address, both for the rendezvous store
(``--rdzv-endpoint``'s port) and for the store the workers bootstrap from (a random port). A
store that any host on the network can write to is an open door into the job. ``TCPStore``
does accept a socket that is already listening (``master_listen_fd``), so this module registers
a rendezvous backend, ``sluice-loopback``, whose two stores listen on a socket bound to
127.0.0.1, and runs torchrun with it (``python -m sluice.stages.run.rendezvous <torchrun
arguments>``). The launcher also sets ``GLOO_SOCKET_IFNAME=lo`` / ``NCCL_SOCKET_IFNAME=lo`` so
the collectives' own sockets stay on loopback too.

Several machines still use torchrun's own ``c10d`` backend (see ``launch``); what each node
opens is listed in docs/security.md.
"""
from __future__ import annotations

import datetime
import socket
import sys

BACKEND = "sluice-loopback"
LOOPBACK = "127.0.0.1"


def loopback_store(port: int, timeout_s: float):
    """A multi-tenant ``TCPStore`` server listening on 127.0.0.1 only (``port`` 0: any free)."""
    import torch.distributed as dist
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((LOOPBACK, port))
    sock.listen(512)
    port = sock.getsockname()[1]
    return dist.TCPStore(LOOPBACK, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s), master_listen_fd=sock.detach())


def create_handler(params):
    """The ``sluice-loopback`` rendezvous handler: torchrun's dynamic rendezvous over a c10d
    backend, with both of its stores on loopback. Single node only."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (DynamicRendezvousHandler,
                                                                         RendezvousTimeout)
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    timeout_s = params.get_as_int("read_timeout", 60)

    class LoopbackHandler(DynamicRendezvousHandler):
        def _create_tcp_store_server(self, master_addr, master_port):  # the workers' store
            return loopback_store(master_port, timeout_s)

        def get_backend(self) -> str:
            return BACKEND

    if params.max_nodes != 1:
        raise ValueError(f"the {BACKEND} rendezvous serves one node; use c10d for several")
    _, port = parse_rendezvous_endpoint(params.endpoint, default_port=29400)
    store = loopback_store(port, timeout_s)
    timeouts = {k: params.get_as_int(f"{k}_timeout") for k in ("join", "last_call", "close", "heartbeat")}
    timeout = RendezvousTimeout(*(None if v is None else datetime.timedelta(seconds=v) for v in timeouts.values()))
    return LoopbackHandler.from_backend(params.run_id, store, C10dRendezvousBackend(store, params.run_id),
                                        params.min_nodes, params.max_nodes, LOOPBACK, timeout)


def main(argv: list[str]) -> None:
    """torchrun with the ``sluice-loopback`` backend registered."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry
    from torch.distributed.run import main as torchrun
    rendezvous_handler_registry.register(BACKEND, create_handler)
    torchrun(argv)


if __name__ == "__main__":
    main(sys.argv[1:])
