"""What producer and consumer sidecars compute alike about a held request, each from what it
knows: the hold board's words and the marker a live hold publishes there (``board``), the claim
a READ_DONE makes of the held blocks it read (``claims``), the integrity canary over the bytes
read (``canary``), and where a staged hold's copy sits in the producer's staging pool
(``staging``). Pure: standard library, numpy and ``kvsidecar.errors``, like the rest of ``plan``.
"""
