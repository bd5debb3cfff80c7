/* unit.conn_budget: each uid's buffering figures (daemon/conn_budget.c).
 * A connection whose uid entry could not be made at accept (out of memory
 * growing the table: realloc fails on demand here, through the linker's
 * --wrap) is counted nowhere: when it closes and is freed it takes nothing
 * from the entry a later connection of the same uid made. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <uv.h>

#include "daemon/conn.h"

static bool fail_realloc;
void *__real_realloc(void *p, size_t n);
void *__wrap_realloc(void *p, size_t n);
void *__wrap_realloc(void *p, size_t n)
{
    return fail_realloc ? NULL : __real_realloc(p, n);
}

static pb_conns_t set;
static pb_config_t cfg;

static pb_conn_t *new_conn(uid_t uid)
{
    pb_conn_t *c = calloc(1, sizeof *c);
    assert_non_null(c);
    c->set = &set;
    c->uid = uid;
    return c;
}

static void gone(pb_conn_t *c)
{
    pb__conns_closed(&set, c);
    pb__conns_leave(&set, c);
    free(c);
}

static const pb_uid_use_t *entry(uid_t uid)
{
    for (size_t i = 0; i < set.nuids; i++)
        if (set.uids[i].uid == uid)
            return &set.uids[i];
    return NULL;
}

static void uncounted_takes_nothing(void **state)
{
    (void)state;
    /* Fill the uid table to its capacity: one more uid must grow it. */
    pb_conn_t *fill[64];
    size_t nfill = 0;
    do {
        fill[nfill] = new_conn((uid_t)(100 + nfill));
        assert_true(pb__conns_admit(&set, fill[nfill], NULL));
        nfill++;
    } while (set.nuids < set.capuids && nfill < 64);
    assert_int_equal(set.nuids, set.capuids);

    /* uid 2000's first connection: no room for its entry. */
    fail_realloc = true;
    pb_conn_t *b = new_conn(2000);
    size_t open = 0;
    assert_false(pb__conns_admit(&set, b, &open));
    assert_int_equal(open, 0); /* out of memory, not a count */
    fail_realloc = false;
    assert_false(b->counted);
    assert_null(entry(2000));

    /* A filler leaves, and uid 2000's next connection gets an entry. */
    gone(fill[--nfill]);
    pb_conn_t *c = new_conn(2000);
    assert_true(pb__conns_admit(&set, c, NULL));
    assert_true(c->counted);
    c->cap = 4096;
    pb__conn_account(c);
    const pb_uid_use_t *u = entry(2000);
    assert_non_null(u);
    assert_int_equal(u->open, 1);
    assert_int_equal(u->members, 1);
    assert_int_equal(u->held, 4096);

    /* The uncounted one buffers a little, closes and is freed: uid
     * 2000's entry is c's alone, as before. */
    b->cap = 1024;
    pb__conn_account(b);
    assert_int_equal(set.held, 4096 + 1024);
    gone(b);
    u = entry(2000);
    assert_non_null(u);
    assert_int_equal(u->open, 1);
    assert_int_equal(u->members, 1);
    assert_int_equal(u->held, 4096);
    assert_int_equal(set.held, 4096);

    c->cap = 0;
    pb__conn_account(c);
    gone(c);
    assert_null(entry(2000));
    while (nfill > 0)
        gone(fill[--nfill]);
    assert_int_equal(set.nuids, 0);
    assert_null(set.uids);
    assert_int_equal(set.held, 0);
}

int main(void)
{
    char err[256];
    char *argv[] = {"unit_conn_budget", NULL};
    assert_int_equal(pb_config_load(&cfg, 1, argv, NULL, err, sizeof err), 0);
    pb_conns_init(&set, uv_default_loop(), &cfg, (pb_conn_cbs_t){0});
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(uncounted_takes_nothing),
    };
    int rc = cmocka_run_group_tests_name("unit.conn_budget", tests, NULL, NULL);
    pb_conns_destroy(&set);
    uv_run(uv_default_loop(), UV_RUN_DEFAULT);
    uv_loop_close(uv_default_loop());
    return rc;
}
