/* import_families.h - qmoe-bank's views of the family table
 * (model/qm_families.h): the help's list and `qmoe-bank import --families`. */
#ifndef QMOE_IMPORT_FAMILIES_H
#define QMOE_IMPORT_FAMILIES_H

#include <stdio.h>

#include "qm_families.h"

/* The help's list of families: one line per family, indented. */
void qm__family_help(FILE *f, int gguf);
/* The table as JSON (`qmoe-bank import --families`), one object per family. */
void qm__families_json(FILE *f);

#endif
