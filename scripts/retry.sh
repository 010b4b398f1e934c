#!/usr/bin/env bash
# retry.sh TIMES PAUSE_S COMMAND...: run COMMAND until it succeeds, at most TIMES times, PAUSE_S
# seconds apart (for steps that fail while another build on the host holds a lock, e.g. apt's).
set -u
times=$1 pause=$2
shift 2
for ((i = 1; i <= times; i++)); do
  "$@" && exit 0
  ((i < times)) && sleep "$pause"
done
exit 1
