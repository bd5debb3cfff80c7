/* RUNNING_ON_VALGRIND from valgrind's header where it is installed, else
 * 0: for the tests that run a lighter set of cases under run_all's
 * memcheck stage. */
#ifndef PB_TESTS_ON_VALGRIND_H
#define PB_TESTS_ON_VALGRIND_H

#if defined(__has_include)
#if __has_include(<valgrind/valgrind.h>)
#include <valgrind/valgrind.h>
#endif
#endif
#ifndef RUNNING_ON_VALGRIND
#define RUNNING_ON_VALGRIND 0
#endif

#endif
