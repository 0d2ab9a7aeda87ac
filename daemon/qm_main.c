/* qm_main.c - the qmoed executable; everything else is in qmoed_core so the
 * unit tests can link it. */
#include "qm_daemon.h"

int main(int argc, char **argv) { return qm_daemon_main(argc, argv); }
