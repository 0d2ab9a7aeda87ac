/* wire_check - the daemon's request decoder on stdin, for the tests that
 * check what the clients send against the wire's rows (tests/clients
 * test_client_calls.py): each line is decoded as qmoed decodes a frame,
 * and one line per request is written: `ok METHOD` or `error CODE FIELD
 * REASON`. Exit status 0 when every request decoded. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "qm_protocol.h"

int main(void)
{
    qm_proto_limits lim;
    qm_proto_limits_default(&lim);
    size_t cap = 0;
    char *line = NULL;
    ssize_t n;
    int bad = 0;
    while ((n = getline(&line, &cap, stdin)) > 0) {
        while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r'))
            line[--n] = '\0';
        if (n == 0)
            continue;
        qm_rpc_frame f;
        if (qm_rpc_decode(line, (size_t)n, &lim, &f) < 0) {
            printf("error -32603 - out of memory\n");
            bad = 1;
            continue;
        }
        for (size_t i = 0; i < f.n; i++) {
            const qm_rpc_item *it = &f.items[i];
            if (it->ok) {
                printf("ok %s\n", qm_method_name(it->req.method));
            } else {
                printf("error %d %s %s\n", it->rpc_code,
                       it->status.field[0] ? it->status.field : "-", it->status.msg);
                bad = 1;
            }
        }
        qm_rpc_frame_free(&f);
    }
    free(line);
    return bad;
}
