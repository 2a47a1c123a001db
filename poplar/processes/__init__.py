"""Process plumbing: ranks spawned over gloo with a deadline (``spawn``), SIGTERM counted across a collective
(``sigterm``), workers that answer jobs in processes of their own (``pool``). It knows nothing of training."""
