// assert.h (gpt2np CUDA emulator): the C library's assert.h, then an assert that reports a
// failing kernel assertion as a launch error instead of aborting the Python process.
// No include guard, like the C header: every inclusion redefines assert.
#include_next <assert.h>
#undef assert
#ifdef NDEBUG
#define assert(e) ((void)0)
#else
#define assert(e) ((e) ? (void)0 : ::__emu::assert_fail(#e, __FILE__, __LINE__))
#endif
