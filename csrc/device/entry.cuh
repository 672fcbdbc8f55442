// The entry of every ubnext kernel: the one parameter list (docs/ARCHITECTURE.md, "Kernel ABI") and
// what each kernel does before anything else.
//
// The descriptor is a parameter BY VALUE. Kernel parameters live in the constant bank, which the launch
// fills, so the fields a prologue needs (rank, nranks, peer bases, mc_base, the region offsets) are there
// at the first instruction: no chain of dependent global loads (rank, then peer_base[rank], then a sync
// word) before the first push, and a push loop's peer base is a constant-bank operand, not a global load
// that the asm "memory" clobbers would force again before every store. The copy at the pool base stays
// the pool's header (the host writes it, the C API's host copy must equal it); kernels do not read it.
// Size: the descriptor is 256 bytes whatever the world size (UBNEXT_MAX_RANKS = 16 peer bases) and the
// whole list 328 bytes, within the 4 KB that sm_70 and later take at any CUDA version (32 KB from 12.1).
#pragma once

#include "platform.cuh"
#include "desc.cuh"
#include "ptx.cuh"

// __grid_constant__: the descriptor is read-only for the whole grid, so taking its address gives the
// parameter's own (constant bank) address. Without it, a helper that takes `&desc` and stops being inlined
// (an ABI call with a generic pointer) makes ptxas copy the 256 bytes to every thread's stack frame: local
// memory, and loads of it on every use. The frame check (python -m ubnext.kernels build --fail-on-spill)
// refuses any stack frame; tests/unit/test_kernels_compile.py shows it catching that copy under the
// test-only UBNEXT_BREAK_DESC_COPY (no __grid_constant__) with UBNEXT_TEST_DESC_NOINLINE (barrier.cuh).
// The emulator defines __grid_constant__ empty (emu_prelude.h, shim/crt/host_defines.h).
#if !defined(UBNEXT_BREAK_DESC_COPY)
#define UBX_DESC_PARAM const __grid_constant__ ubnext_comm_desc desc
#else
#define UBX_DESC_PARAM const ubnext_comm_desc desc
#endif
#define UBX_KERNEL_PARAMS                                                                                  \
  UBX_DESC_PARAM, const void *in, void *out, const void *residual, void *residual_out, const void *weight, \
      const float *scale, float *scale_inv, int n, int hidden, float eps, int flags

// extern "C" __global__ with the one parameter list; the body starts with UBX_KERNEL_BEGIN.
#define UBX_KERNEL(NAME) extern "C" __global__ void NAME(UBX_KERNEL_PARAMS)

namespace ubx {

// The first statement of every kernel, before any memory access: the previous kernel on the stream may
// still be running under programmatic dependent launch (ptx.cuh, griddep_wait), and what it wrote (our
// inputs, the pool's sync words and buffers) is ours to read only after this. The compiler may still
// schedule the prologue's arithmetic on parameters around it (in SASS the wait, ACQBULK, comes after a
// few constant-bank loads and before any global one). UBNEXT_BREAK_NO_PDL_WAIT (test-only) leaves it
// out; the emulator then fails the launch at the kernel's first memory access.
//
// UBNEXT_BREAK_EARLY_TRIGGER (test-only, ONE RANK only: tests/gpu/test_gpu_pdl.py) triggers the dependents
// here, before this kernel has read or written anything, so that on a GPU the next kernel of a PDL chain
// really starts early: with the wait it must still read finished inputs; with NO_PDL_WAIT too, it reads
// them unwritten. Never with peers: the no-deadlock argument of the grid cap (csrc/host/launch_rules.h,
// pair_grid_cap) needs every kernel to trigger only after its last wait on a peer, so that a dependent
// parked in griddepcontrol.wait holds SMs only while its primary waits on nobody; an early dependent can
// hold the SMs that another communicator's kernel, on which a peer's kernel waits, needs. The emulator
// serialises launches, so it has no such build.
UBX_DEV void kernel_begin() {
#if defined(UBNEXT_BREAK_EARLY_TRIGGER)
  griddep_launch_dependents();
#endif
#if !defined(UBNEXT_BREAK_NO_PDL_WAIT)
  griddep_wait();
#endif
}

}  // namespace ubx
