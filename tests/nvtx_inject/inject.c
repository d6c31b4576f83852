/*
 * inject.c - a tiny NVTX v3 injection library that logs every range push and pop.
 *
 * Used only by tests/test_nvtx.py to prove which NVTX ranges gpt2np emits, and how they nest,
 * without a GPU or Nsight Systems.
 *
 * How NVTX injection works (see nvtx3/nvtxDetail/nvtxInit.h): on the first NVTX call, the NVTX
 * code compiled into the application (here: the C extension inside the `nvtx` Python package)
 * dlopen()s the library named by the env var NVTX_INJECTION64_PATH and calls its exported
 * `int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t getExportTable)`. The library asks for
 * the callbacks export table, and through it for each module's function table: an array of
 * pointers to the application's function-pointer slots, indexed by callback id. Writing our
 * functions into those slots routes the NVTX API calls here. Slots left alone become no-ops.
 *
 * The NVTX ABI pieces used are restated below so the library builds without the NVTX headers
 * (the `nvtx` wheel does not ship them). With -DINJECT_CHECK_HEADERS and the nvtx3 headers on the
 * include path, static asserts compare every restated constant and layout against the headers.
 *
 * Log format (env var NVTX_INJECT_LOG names the file; stderr when unset), one event per line,
 * fields separated by tabs, text fields escaped (\\ \t \n):
 *     push <tid> <depth> <domain> <message>     depth = number of open ranges before this push
 *     pop  <tid> <depth> <domain>               depth = number of open ranges after this pop
 * <tid> is the Linux thread id (Python: threading.get_native_id()); <domain> is "" for the
 * default domain; depth counts ranges open on this thread over all domains; a pop with nothing
 * open is logged with depth -1. Each line goes out in one write() to an O_APPEND descriptor, so
 * lines from different threads never interleave.
 *
 * Build: gcc -shared -fPIC -O2 -o libnvtx_inject.so inject.c
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <wchar.h>

/* ---- the NVTX v3 ABI subset we use ------------------------------------------------------ */

enum { ETID_CALLBACKS = 1 };                              /* NVTX_ETID_CALLBACKS */
enum { MODULE_CORE = 1, MODULE_CORE2 = 5 };               /* NVTX_CB_MODULE_CORE / _CORE2 */
enum {                                                    /* NVTX_CBID_CORE_* */
    CORE_RangePushEx = 8, CORE_RangePushA = 9, CORE_RangePushW = 10, CORE_RangePop = 11,
};
enum {                                                    /* NVTX_CBID_CORE2_* */
    CORE2_DomainRangePushEx = 4, CORE2_DomainRangePop = 5,
    CORE2_DomainRegisterStringA = 10, CORE2_DomainRegisterStringW = 11,
    CORE2_DomainCreateA = 12, CORE2_DomainCreateW = 13,
};
enum { MSG_ASCII = 1, MSG_UNICODE = 2, MSG_REGISTERED = 3 };  /* NVTX_MESSAGE_TYPE_* */

typedef struct EventAttributes {        /* nvtxEventAttributes_v2 */
    uint16_t version;
    uint16_t size;
    uint32_t category;
    int32_t color_type;
    uint32_t color;
    int32_t payload_type;
    int32_t reserved0;
    uint64_t payload;                   /* union of 8-byte and smaller numbers */
    int32_t message_type;
    union { const char *ascii; const wchar_t *unicode; const void *registered; } message;
} EventAttributes;

typedef void (*FunctionPointer)(void);
typedef FunctionPointer **FunctionTable;  /* table[cbid] points at the application's slot */
typedef struct ExportTableCallbacks {     /* NvtxExportTableCallbacks */
    size_t struct_size;
    int (*get_module_function_table)(int module, FunctionTable *out_table, unsigned int *out_size);
} ExportTableCallbacks;
typedef const void *(*GetExportTable)(uint32_t export_table_id);

/* Handles we hand out: a registered string and a domain are both just their (owned) UTF-8 name. */
typedef struct Name { char *text; } Name;

#ifdef INJECT_CHECK_HEADERS
#include <nvtx3/nvToolsExt.h>
#define SAME(ours, theirs) _Static_assert((int)(ours) == (int)(theirs), #ours " != " #theirs)
SAME(ETID_CALLBACKS, NVTX_ETID_CALLBACKS);
SAME(MODULE_CORE, NVTX_CB_MODULE_CORE);
SAME(MODULE_CORE2, NVTX_CB_MODULE_CORE2);
SAME(CORE_RangePushEx, NVTX_CBID_CORE_RangePushEx);
SAME(CORE_RangePushA, NVTX_CBID_CORE_RangePushA);
SAME(CORE_RangePushW, NVTX_CBID_CORE_RangePushW);
SAME(CORE_RangePop, NVTX_CBID_CORE_RangePop);
SAME(CORE2_DomainRangePushEx, NVTX_CBID_CORE2_DomainRangePushEx);
SAME(CORE2_DomainRangePop, NVTX_CBID_CORE2_DomainRangePop);
SAME(CORE2_DomainRegisterStringA, NVTX_CBID_CORE2_DomainRegisterStringA);
SAME(CORE2_DomainRegisterStringW, NVTX_CBID_CORE2_DomainRegisterStringW);
SAME(CORE2_DomainCreateA, NVTX_CBID_CORE2_DomainCreateA);
SAME(CORE2_DomainCreateW, NVTX_CBID_CORE2_DomainCreateW);
SAME(MSG_ASCII, NVTX_MESSAGE_TYPE_ASCII);
SAME(MSG_UNICODE, NVTX_MESSAGE_TYPE_UNICODE);
SAME(MSG_REGISTERED, NVTX_MESSAGE_TYPE_REGISTERED);
SAME(sizeof(EventAttributes), sizeof(nvtxEventAttributes_t));
SAME(offsetof(EventAttributes, message_type), offsetof(nvtxEventAttributes_t, messageType));
SAME(offsetof(EventAttributes, message), offsetof(nvtxEventAttributes_t, message));
SAME(offsetof(ExportTableCallbacks, get_module_function_table),
     offsetof(NvtxExportTableCallbacks, GetModuleFunctionTable));
#endif

/* ---- logging ----------------------------------------------------------------------------- */

static int log_fd = 2;
static __thread int thread_depth;  /* ranges open on this thread */

/* Appends `text` to buf at *pos with \\, \t, \n escaped; stops short of the end of buf. */
static void append_escaped(char *buf, size_t cap, size_t *pos, const char *text)
{
    for (; text && *text && *pos + 3 < cap; ++text) {
        char c = *text;
        if (c == '\\' || c == '\t' || c == '\n') {
            buf[(*pos)++] = '\\';
            c = c == '\t' ? 't' : c == '\n' ? 'n' : '\\';
        }
        buf[(*pos)++] = c;
    }
}

static void log_event(const char *kind, int depth, const Name *domain, const char *message)
{
    char line[4096];
    size_t pos = (size_t)snprintf(line, sizeof line, "%s\t%ld\t%d\t", kind,
                                  (long)syscall(SYS_gettid), depth);
    append_escaped(line, sizeof line, &pos, domain ? domain->text : "");
    if (message) {
        line[pos++] = '\t';
        append_escaped(line, sizeof line, &pos, message);
    }
    line[pos++] = '\n';
    if (write(log_fd, line, pos) < 0) { /* nothing useful to do in a test logger */ }
}

/* ---- names ------------------------------------------------------------------------------- */

static char *utf8_from_wide(const wchar_t *wide)
{
    size_t n = wide ? wcslen(wide) : 0, pos = 0;
    char *out = malloc(4 * n + 1);
    if (!out) return NULL;
    for (size_t i = 0; i < n; ++i) {  /* code points to UTF-8, no locale needed */
        uint32_t c = (uint32_t)wide[i];
        if (c < 0x80) { out[pos++] = (char)c; }
        else if (c < 0x800) { out[pos++] = (char)(0xC0 | c >> 6); out[pos++] = (char)(0x80 | (c & 0x3F)); }
        else if (c < 0x10000) {
            out[pos++] = (char)(0xE0 | c >> 12); out[pos++] = (char)(0x80 | (c >> 6 & 0x3F));
            out[pos++] = (char)(0x80 | (c & 0x3F));
        } else {
            out[pos++] = (char)(0xF0 | c >> 18); out[pos++] = (char)(0x80 | (c >> 12 & 0x3F));
            out[pos++] = (char)(0x80 | (c >> 6 & 0x3F)); out[pos++] = (char)(0x80 | (c & 0x3F));
        }
    }
    out[pos] = '\0';
    return out;
}

/* Handles live until the process exits: NVTX never tells us a registered string is unused. */
static Name *new_name(char *owned_text)
{
    Name *name = malloc(sizeof *name);
    if (name) name->text = owned_text ? owned_text : strdup("");
    return name;
}

static Name *register_string_a(const Name *domain, const char *text)
{ (void)domain; return new_name(strdup(text ? text : "")); }
static Name *register_string_w(const Name *domain, const wchar_t *text)
{ (void)domain; return new_name(utf8_from_wide(text)); }
static Name *domain_create_a(const char *text) { return new_name(strdup(text ? text : "")); }
static Name *domain_create_w(const wchar_t *text) { return new_name(utf8_from_wide(text)); }

/* ---- ranges ------------------------------------------------------------------------------ */

static int push(const Name *domain, const char *message)
{
    int depth = thread_depth++;
    log_event("push", depth, domain, message);
    return depth;
}

static int pop(const Name *domain)
{
    if (thread_depth == 0) { log_event("pop", -1, domain, NULL); return -1; }
    int depth = --thread_depth;
    log_event("pop", depth, domain, NULL);
    return depth;
}

static int push_attributes(const Name *domain, const EventAttributes *attr)
{
    if (!attr) return push(domain, "");
    switch (attr->message_type) {
    case MSG_ASCII: return push(domain, attr->message.ascii);
    case MSG_REGISTERED:
        return push(domain, attr->message.registered
                    ? ((const Name *)attr->message.registered)->text : "");
    case MSG_UNICODE: {
        char *text = utf8_from_wide(attr->message.unicode);
        int depth = push(domain, text);
        free(text);
        return depth;
    }
    default: return push(domain, "");
    }
}

static int range_push_ex(const EventAttributes *attr) { return push_attributes(NULL, attr); }
static int range_push_a(const char *message) { return push(NULL, message); }
static int range_push_w(const wchar_t *message)
{
    char *text = utf8_from_wide(message);
    int depth = push(NULL, text);
    free(text);
    return depth;
}
static int range_pop(void) { return pop(NULL); }
static int domain_range_push_ex(const Name *domain, const EventAttributes *attr)
{ return push_attributes(domain, attr); }
static int domain_range_pop(const Name *domain) { return pop(domain); }

/* ---- entry point ------------------------------------------------------------------------- */

static int attach(const ExportTableCallbacks *callbacks, int module, unsigned int cbid,
                  FunctionPointer function)
{
    FunctionTable table = NULL;
    unsigned int size = 0;
    if (!callbacks->get_module_function_table(module, &table, &size) || !table || cbid >= size)
        return 0;
    *table[cbid] = function;
    return 1;
}

__attribute__((visibility("default")))
int InitializeInjectionNvtx2(GetExportTable get_export_table)
{
    const ExportTableCallbacks *callbacks = get_export_table(ETID_CALLBACKS);
    if (!callbacks || callbacks->struct_size < sizeof *callbacks) return 0;

    /* Each copy of the NVTX code in the process (one per C extension) calls us once;
     * open the log the first time only. */
    static int opened;
    if (!__atomic_exchange_n(&opened, 1, __ATOMIC_SEQ_CST)) {
        const char *path = getenv("NVTX_INJECT_LOG");
        if (path && *path) {
            log_fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
            if (log_fd < 0) {
                fprintf(stderr, "nvtx_inject: cannot open NVTX_INJECT_LOG file %s\n", path);
                return 0;
            }
        }
    }

    int ok = 1;
    ok &= attach(callbacks, MODULE_CORE, CORE_RangePushEx, (FunctionPointer)range_push_ex);
    ok &= attach(callbacks, MODULE_CORE, CORE_RangePushA, (FunctionPointer)range_push_a);
    ok &= attach(callbacks, MODULE_CORE, CORE_RangePushW, (FunctionPointer)range_push_w);
    ok &= attach(callbacks, MODULE_CORE, CORE_RangePop, (FunctionPointer)range_pop);
    ok &= attach(callbacks, MODULE_CORE2, CORE2_DomainRangePushEx, (FunctionPointer)domain_range_push_ex);
    ok &= attach(callbacks, MODULE_CORE2, CORE2_DomainRangePop, (FunctionPointer)domain_range_pop);
    ok &= attach(callbacks, MODULE_CORE2, CORE2_DomainRegisterStringA, (FunctionPointer)register_string_a);
    ok &= attach(callbacks, MODULE_CORE2, CORE2_DomainRegisterStringW, (FunctionPointer)register_string_w);
    ok &= attach(callbacks, MODULE_CORE2, CORE2_DomainCreateA, (FunctionPointer)domain_create_a);
    ok &= attach(callbacks, MODULE_CORE2, CORE2_DomainCreateW, (FunctionPointer)domain_create_w);
    return ok;
}
