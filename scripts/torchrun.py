#!/usr/bin/python3
"""torchrun, for a PyTorch built without libuv (e.g. Debian 13's python3-torch 2.6).

    /usr/bin/python3 scripts/torchrun.py --nproc_per_node 2 --redirects 1 --tee 1 \\
        --no_python build/bin/train_gpt --steps 100

Takes torchrun's own arguments and runs torch.distributed.run. Why it exists:
PyTorch 2.4+ asks for the libuv TCPStore server by default, and torchrun's "static"
and "c10d" rendezvous create their store without passing use_libuv, so on a build
without libuv torchrun fails before any worker starts ("use_libuv was requested but
PyTorch was build without libuv support"); USE_LIBUV=0 does not reach those stores.
Here the rendezvous modules get a TCPStore whose use_libuv defaults to False. The
workers (this project's programs) connect to that store as clients, which works with
either server. On a PyTorch with libuv (PyPI's, pytorch.org's) it is plain torchrun with
the classic store server.
"""
import functools
import sys

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend, static_tcp_rendezvous

store = functools.partial(dist.TCPStore, use_libuv=False)
static_tcp_rendezvous.TCPStore = store
c10d_rendezvous_backend.TCPStore = store

from torch.distributed.run import main  # noqa: E402

if __name__ == "__main__":
    sys.argv[0] = "torchrun"
    sys.exit(main())
