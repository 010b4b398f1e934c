"""How a step's work travels between the connector's halves and the sidecars: the values
(:mod:`.work`), the worker's Session stream on its I/O thread (:mod:`.channel`), the lanes
driven without one (:mod:`.lane`: the worker's Session lane, the scheduler's step lanes) and the
scheduler's own sends at the moment it decides (:mod:`.sends`)."""
