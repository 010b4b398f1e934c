"""``kvsidecar bench``: a real local cluster measured beside raw NIXL and memcpy on the same bytes
(``run``), its targets and report (``report``), the measured cluster (``target``), load helpers
(``load``), the raw-NIXL baseline and its target process (``nixl_baseline``) and the scrapes of
sidecar metrics and CPU time (``scrape``)."""
