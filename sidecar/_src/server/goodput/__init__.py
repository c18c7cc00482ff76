"""The trainers' time as the sidecar sees it: the goodput ledgers, each session's steps."""
