"""The small pieces every layer shares: wire names, the error tree, atomic and private file
writes, the control credential, the demo's names, the tier keys. Nothing here imports
another part of servemesh, so any module, a service's included, may use them."""
