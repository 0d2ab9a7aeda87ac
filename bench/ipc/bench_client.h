/* bench_client.h - what the socket benches do first: connect to the daemon
 * and find the bank they drive (static inline, as bench_util.h). */
#ifndef QMOE_BENCH_CLIENT_H
#define QMOE_BENCH_CLIENT_H

#include <stdio.h>
#include <string.h>

#include "qmoe_client.h"

/* Opens a client on sock and fills *shape with model's numbers (its
 * strings left NULL). Returns NULL, with a line on stderr, when the daemon
 * cannot be reached or has no such model. */
static inline qm_client *bench_connect(const char *sock, const char *model,
                                       qm_client_model *shape)
{
    qm_client *c;
    qm_client_error err;
    if (qm_client_open(&c, sock, 600000, &err) < 0) {
        fprintf(stderr, "open: %s\n", err.reason);
        return NULL;
    }
    qm_client_model *models;
    size_t n_models;
    int found = 0;
    memset(shape, 0, sizeof *shape);
    if (qm_client_model_list(c, &models, &n_models, &err) == 0) {
        for (size_t i = 0; i < n_models && !found; i++)
            if (!strcmp(models[i].name, model)) {
                *shape = models[i];
                shape->name = shape->path = shape->activation = NULL;
                found = 1;
            }
        qm_client_models_free(models, n_models);
    }
    if (!found || !shape->hidden_size) {
        fprintf(stderr, "no model %s in the daemon\n", model);
        qm_client_close(c);
        return NULL;
    }
    return c;
}

#endif
