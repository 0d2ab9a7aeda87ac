/* qm_idle_hint.c - see qm_idle_hint.h. */
#include "qm_idle_hint.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The file's first line without its newline; 0, or -1 when unreadable. */
static int first_line(const char *path, char *out, size_t cap)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    char *got = fgets(out, (int)cap, f);
    fclose(f);
    if (!got)
        return -1;
    out[strcspn(out, "\n")] = '\0';
    return 0;
}

int qm_idle_hint(const char *driver_path, const char *poll_path, char *msg, size_t cap)
{
    char driver[64], poll[64];
    if (first_line(driver_path, driver, sizeof driver) < 0 || strcmp(driver, "haltpoll") != 0)
        return 0;
    if (first_line(poll_path, poll, sizeof poll) < 0 || !poll[0])
        return 0;
    char *end;
    unsigned long long ns = strtoull(poll, &end, 10);
    if (*end != '\0' || poll[0] == '-' || ns != 0)
        return 0;
    snprintf(msg, cap,
             "this KVM guest halts an idle vCPU at once (cpuidle haltpoll, %s 0): each wake-up "
             "of a layer call waits for the host, tens of microseconds; docs/OPERATIONS.md, "
             "\"On a virtual machine\"",
             poll_path);
    return 1;
}
