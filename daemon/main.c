/* pullbackd: serve automatic-differentiation rules over msgpack-RPC. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "../cuda/gpu.h"
#include "../kernels/tensor.h"
#include "config.h"
#include "log.h"
#include "sd.h"
#include "server.h"

int main(int argc, char **argv)
{
    pb_config_t cfg;
    char err[512];
    int rc = pb_config_load(&cfg, argc, argv, PB_CONFIG_FILE, err, sizeof err);
    if (rc) {
        if (rc < 0) {
            /* Before the log level is known: an error line always shows. */
            pb_log(PB_LOG_ERR, "bad configuration: %s (%s)", err, pb_strerror_code(rc));
            pb_sd_notify("STATUS=bad configuration: %.200s", err);
        }
        return rc > 0 ? 0 : 2;
    }
    pb_log_level = cfg.log_level;
    pb_config_warn(&cfg);
    char why[200] = "";
    int ngpu = pb_gpu_init(why, sizeof why);
    if (ngpu < 0) {
        pb_log(PB_LOG_ERR, "%s", why);
        return 2;
    }
    const char *whynot = "";
    const pb_gpu_backend_t *real = ngpu == 0 ? pb__gpu_real(&whynot) : NULL;
    if (real)
        whynot = real->last_error(); /* the module's, from its count() */
    if (ngpu == 0)
        pb_log(PB_LOG_INFO, "no GPUs: %s", whynot);
    else {
        for (int g = 0; g < ngpu; g++) {
            pb_gpu_info_t info = {.total_bytes = 0};
            pb_gpu->info(g, &info);
            pb_log(PB_LOG_INFO, "cuda:%d: %s, %zu MiB (%s backend)", g, info.name, info.total_bytes >> 20,
                   pb_gpu->name);
        }
    }
    if (cfg.device.kind != PB_DEV_CPU && cfg.device.index >= ngpu) {
        /* The flag or the file: say both where there is a file. */
        const char *from = cfg.config_file[0] ? "--device, or device = in " : "--device";
        if (ngpu == 0)
            pb_log(PB_LOG_ERR, "device cuda:%d (%s%s): this daemon has no CUDA devices (%s)", cfg.device.index,
                   from, cfg.config_file, whynot);
        else
            pb_log(PB_LOG_ERR, "device cuda:%d (%s%s): this daemon has %d GPU%s (cuda:0 to cuda:%d)",
                   cfg.device.index, from, cfg.config_file, ngpu, ngpu == 1 ? "" : "s", ngpu - 1);
        return 1;
    }
    pb_alloc_init();
    signal(SIGPIPE, SIG_IGN);
    uv_loop_t *loop = uv_default_loop();
    pb_server_t srv;
    if ((rc = pb_server_init(&srv, loop, &cfg, argc, argv, PB_CONFIG_FILE))) {
        pb_log(PB_LOG_ERR, "startup failed: %s (%s)", pb_strerror(rc), pb_strerror_code(rc));
        return 1;
    }
    if (pb_server_listen(&srv)) {
        srv.stopping = true;
        pb_server_destroy(&srv);
        uv_loop_close(loop);
        return 1;
    }
    uv_run(loop, UV_RUN_DEFAULT);
    /* A drain cut short with workers stuck in a computation: the socket
     * file is gone, the connections are closed and systemd has heard
     * STOPPING=1; joining the workers could take minutes, so exit now. */
    if (pb_server_abandoned(&srv)) {
        pb_log(PB_LOG_NOTICE, "stopped");
        _exit(0);
    }
    pb_server_destroy(&srv);
    /* A handle left open is a bug the tests that assert a clean exit
     * should see. */
    rc = uv_loop_close(loop);
    if (rc) {
        pb_log(PB_LOG_ERR, "stopped with handles left open: %s", uv_strerror(rc));
        return 1;
    }
    pb_log(PB_LOG_NOTICE, "stopped");
    return 0;
}
