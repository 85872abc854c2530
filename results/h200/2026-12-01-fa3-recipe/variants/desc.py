import re, shutil, os, sys
src_dir, dst_dir = sys.argv[1], sys.argv[2]
src = open(f'{src_dir}/kernel.cu').read()
adv = '''// A descriptor `bytes` further on: the start address field plus bytes / 16. Exact as long as the address stays
// below 256 KB (the field's 14 bits), which every shared-memory address does: only the low word changes.
__device__ __forceinline__ uint64_t wgmma_desc_advance(uint64_t desc, uint32_t bytes) {
    const uint32_t lo = uint32_t(desc) + (bytes >> 4), hi = uint32_t(desc >> 32);
    uint64_t d;
    asm("mov.b64 %0, {%1, %2};" : "=l"(d) : "r"(lo), "r"(hi));
    return d;
}

'''
i = src.index('namespace {\n') + len('namespace {\n')
src = src[:i] + adv + src[i:]
n0 = len(src)
src = src.replace("        const uint32_t K_tile = smem_u32(smem.K[stage]);", "        const uint64_t Q_desc = wgmma_desc_kmajor(Q_rows), K_desc = wgmma_desc_kmajor(smem_u32(smem.K[stage]));")
src, n1 = re.subn(r"(wgmma_m64n\d+k16_ss\(S_acc, )wgmma_desc_kmajor\(Q_rows \+ half \* Q_HALF_BYTES \+ kstep\),\n(\s+)wgmma_desc_kmajor\(K_tile \+ half \* KV_HALF_BYTES \+ kstep\), kk > 0\);",
                  r"\1wgmma_desc_advance(Q_desc, half * Q_HALF_BYTES + kstep),\n\2wgmma_desc_advance(K_desc, half * KV_HALF_BYTES + kstep), kk > 0);", src)
src = src.replace("        const uint32_t V_tile = smem_u32(smem.V[stage]);", "        const uint64_t V_desc = wgmma_desc_nmajor(smem_u32(smem.V[stage]), KV_HALF_BYTES);")
src = src.replace("wgmma_desc_nmajor(V_tile + kk * 2 * WGMMA_ATOM_BYTES, KV_HALF_BYTES), 1)", "wgmma_desc_advance(V_desc, kk * 2 * WGMMA_ATOM_BYTES), 1)")
assert n1 == 1 and 'K_tile' not in src and 'V_tile' not in src, (n1,)
os.makedirs(dst_dir, exist_ok=True)
open(f'{dst_dir}/kernel.cu','w').write(src)
shutil.copytree(f'{src_dir}/pkg', f'{dst_dir}/pkg', dirs_exist_ok=True)
