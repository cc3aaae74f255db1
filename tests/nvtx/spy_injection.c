/* A minimal NVTX v3 tool for tests: the NVTX loader dlopens this library (NVTX_INJECTION64_PATH) at the
 * first NVTX call and calls InitializeInjectionNvtx2. We fill the CORE2 (domain) slots and log every
 * push/pop as "push <tid> <domain> <message>" / "pop <tid> <domain>" to $SLOTBENCH_NVTX_LOG. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef void (*fn_ptr)(void);
typedef fn_ptr **fn_table;
typedef struct {
    size_t struct_size;
    int (*GetModuleFunctionTable)(int module, fn_table *out_table, unsigned int *out_size);
} callbacks_table;
typedef const void *(*get_export_table_fn)(uint32_t id);

typedef struct {  /* nvtxEventAttributes_v2 */
    uint16_t version, size;
    uint32_t category;
    int32_t color_type;
    uint32_t color;
    int32_t payload_type, reserved0;
    uint64_t payload;
    int32_t message_type;
    const void *message;  /* ascii char*, or a registered string handle */
} event_attributes;

enum { MODULE_CORE2 = 5, CB_PUSH = 4, CB_POP = 5, CB_REGISTER_STRING_A = 10, CB_DOMAIN_CREATE_A = 12,
       MESSAGE_ASCII = 1, MESSAGE_REGISTERED = 3, ETID_CALLBACKS = 1 };

static FILE *log_file;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static const char *message_of(const event_attributes *a) {
    if (!a || !a->message) return "?";
    if (a->message_type == MESSAGE_ASCII || a->message_type == MESSAGE_REGISTERED) return (const char *)a->message;
    return "?";
}

static void *domain_create(const char *name) { return strdup(name ? name : "(default)"); }
static void *register_string(void *domain, const char *s) { (void)domain; return strdup(s); }

static int push(void *domain, const event_attributes *a) {
    pthread_mutex_lock(&lock);
    fprintf(log_file, "push %ld %s %s\n", (long)syscall(SYS_gettid), domain ? (char *)domain : "(default)",
            message_of(a));
    fflush(log_file);
    pthread_mutex_unlock(&lock);
    return 0;
}

static int pop(void *domain) {
    pthread_mutex_lock(&lock);
    fprintf(log_file, "pop %ld %s\n", (long)syscall(SYS_gettid), domain ? (char *)domain : "(default)");
    fflush(log_file);
    pthread_mutex_unlock(&lock);
    return 0;
}

int InitializeInjectionNvtx2(get_export_table_fn get_export_table) {
    const char *path = getenv("SLOTBENCH_NVTX_LOG");
    log_file = fopen(path ? path : "/dev/stderr", "a");  /* appended: the device process logs here too */
    const callbacks_table *cb = (const callbacks_table *)get_export_table(ETID_CALLBACKS);
    fn_table table = NULL;
    unsigned int size = 0;
    if (!log_file || !cb || !cb->GetModuleFunctionTable(MODULE_CORE2, &table, &size) || size <= CB_DOMAIN_CREATE_A)
        return 0;
    *table[CB_DOMAIN_CREATE_A] = (fn_ptr)domain_create;
    *table[CB_REGISTER_STRING_A] = (fn_ptr)register_string;
    *table[CB_PUSH] = (fn_ptr)push;
    *table[CB_POP] = (fn_ptr)pop;
    fprintf(log_file, "init\n");
    fflush(log_file);
    return 1;
}
