"""UCX log samples (UCX_PROTO_INFO tables and a warning) in UCX's own format, shared by the
UCX parser and log tests: from this host (cma), written by hand for a GPU host (cuda_ipc, a TCP
fallback)."""

from __future__ import annotations

AGENT = "kvsidecar-3dbefa6256124105"

# Printed on this host (NIXL 1.5.1, two sidecar processes, a READ of host memory).
CMA_READ = """\
[1795761374.074938] [vm:11663:1]   +--------+-------------+-------------------------------------------+
[1795761374.074938] [vm:11663:1]   | kvsidecar-3dbefa6256124105 intra-node cfg#1                     |
[1795761374.074938] [vm:11663:1]   | remote memory read by ucp_get*(multi) into host memory from host |
[1795761374.074938] [vm:11663:1]   +--------+-------------+-------------------------------------------+
[1795761374.074938] [vm:11663:1]   | Range  | Description |                  Config                   |
[1795761374.074938] [vm:11663:1]   +--------+-------------+-------------------------------------------+
[1795761374.074938] [vm:11663:1]   | 0..inf | zero-copy   | cma/memory                                |
[1795761374.074938] [vm:11663:1]   +--------+-------------+-------------------------------------------+
"""

# The same READ on a GPU host, GPU memory both sides, cuda_ipc GET on (UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y).
CUDA_IPC_READ = """\
[1795800000.100000] [gpu1:20301:0]   +--------+-------------+--------------------------------------------------------+
[1795800000.100000] [gpu1:20301:0]   | kvsidecar-3dbefa6256124105 intra-node cfg#3                                      |
[1795800000.100000] [gpu1:20301:0]   | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[0] |
[1795800000.100000] [gpu1:20301:0]   +--------+-------------+--------------------------------------------------------+
[1795800000.100000] [gpu1:20301:0]   | Range  | Description |                         Config                         |
[1795800000.100000] [gpu1:20301:0]   +--------+-------------+--------------------------------------------------------+
[1795800000.100000] [gpu1:20301:0]   | 0..inf | zero-copy   | cuda_ipc/cuda                                          |
[1795800000.100000] [gpu1:20301:0]   +--------+-------------+--------------------------------------------------------+
"""

# GET zcopy off (no NVLink, the default): UCX emulates the READ with active messages over TCP.
TCP_FALLBACK_READ = """\
[1795800001.200000] [gpu1:20301:0]   +----------+--------------------+-----------------------------------------+
[1795800001.200000] [gpu1:20301:0]   | kvsidecar-3dbefa6256124105 intra-node cfg#3                          |
[1795800001.200000] [gpu1:20301:0]   | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[0] |
[1795800001.200000] [gpu1:20301:0]   +----------+--------------------+-----------------------------------------+
[1795800001.200000] [gpu1:20301:0]   |  Range   |    Description     |                 Config                  |
[1795800001.200000] [gpu1:20301:0]   +----------+--------------------+-----------------------------------------+
[1795800001.200000] [gpu1:20301:0]   |   0..8K  | copy-out           | tcp/eth0                                |
[1795800001.200000] [gpu1:20301:0]   | 8193..inf | software emulation | tcp/eth0                                |
[1795800001.200000] [gpu1:20301:0]   +----------+--------------------+-----------------------------------------+
"""

# Earlier UCX: one title row (configuration | operation), no header; small sizes over another lane.
ONE_ROW_LAYOUT = """\
[1722588785.780930] [ps:655046:0]   +---------------------------+-------------------------------------------------------------------+
[1722588785.780930] [ps:655046:0]   | kvsidecar-3dbefa6256124105 inter-node cfg#2 | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[1] |
[1722588785.780933] [ps:655046:0]   +---------------------------+------------------------------------------+------------------------+
[1722588785.780936] [ps:655046:0]   |                         0 | copy-out                                 | rc_mlx5/mlx5_1:1/path0 |
[1722588785.780938] [ps:655046:0]   |                     1..64 | software emulation                       | rc_mlx5/mlx5_1:1/path0 |
[1722588785.780941] [ps:655046:0]   |                   65..inf | zero-copy                                | rc_mlx5/mlx5_1:1 50% on path0 and 50% on path1 |
[1722588785.780943] [ps:655046:0]   +---------------------------+------------------------------------------+------------------------+
"""

ACTIVE_MESSAGE = """\
[1795761485.048522] [vm:14561 :0]   +-------------+--------------------+---------------------+
[1795761485.048522] [vm:14561 :0]   | kvsidecar-3dbefa6256124105 self cfg#0                  |
[1795761485.048522] [vm:14561 :0]   | active message by ucp_am_send*(multi) from host memory |
[1795761485.048522] [vm:14561 :0]   +-------------+--------------------+---------------------+
[1795761485.048522] [vm:14561 :0]   |    Range    |    Description     |       Config        |
[1795761485.048522] [vm:14561 :0]   +-------------+--------------------+---------------------+
[1795761485.048522] [vm:14561 :0]   |     0..8184 | short              | tcp/lo              |
[1795761485.048522] [vm:14561 :0]   | 8185..65528 | zero-copy          | tcp/lo              |
[1795761485.048522] [vm:14561 :0]   |  65529..inf | multi-frag copy-in | tcp/lo              |
[1795761485.048522] [vm:14561 :0]   +-------------+--------------------+---------------------+
"""

WARNING = (
    "[1795762591.641550] [vm:2906 :0]          parser.c:2578 UCX  WARN  unused environment "
    "variable: UCX_FOO"
)
