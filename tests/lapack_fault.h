/* LAPACK failures on demand for the tests; see lapack_fault.c. */
#ifndef PB_TESTS_LAPACK_FAULT_H
#define PB_TESTS_LAPACK_FAULT_H

/* Fail the drivers `spec` names ("NAME[/N]=INFO,..."; NULL: take
 * $PB_LAPACK_FAULT, "": fail none) and reset the call counts.  The spec
 * is not copied. */
void lapack_fault_set(const char *spec);

/* Calls of the driver NAME ("dgesvd") since the last lapack_fault_set. */
int lapack_fault_calls(const char *name);
/* The leading dimension of A that the last of those calls passed. */
int lapack_fault_lda(const char *name);
/* Its job argument that asks for vectors ('V', 'N', 'S'; 0 for the drivers
 * without one). */
char lapack_fault_job(const char *name);

#endif
