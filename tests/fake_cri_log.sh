#!/bin/sh
# The fake kubelet's container log driver (containerd's binary:// log URI):
# the runc shim hands it the container's stdout and stderr as fds 3 and 4 and
# waits for fd 5 to close. Both streams are appended to one file until each
# ends, as CRI's own copy writes /var/log/pods. ctr's file:// URI is not used:
# containerd 1.6's shim closes the shared file when stdout ends, and what
# stderr writes after is lost (2-3 of 100 exits lost their last stderr line
# on a loaded machine). The shim's SIGTERM at the task's delete is ignored:
# the copies end at EOF, once the shim has closed its ends, so nothing in
# the pipes is lost. Usage (from the URI's query): fake_cri_log.sh log PATH
trap '' TERM
log=$2
/bin/cat <&3 >>"$log" 3<&- 4<&- 5<&- &
/bin/cat <&4 >>"$log" 3<&- 4<&- 5<&- &
exec 3<&- 4<&- 5>&-
wait
