"""A step14 with BLOCK_N = N keys per K/V tile (an m64nNk16 wgmma for S); prints the kernel. Diagnostic only:
no masking, so seqlen_k must be a multiple of N for correct results."""
import sys
from pathlib import Path


def ss(n):
    r=n//2
    regs=", ".join(f"%{i}" for i in range(r))
    outs=", ".join(f'"+f"(d[{i}])' for i in range(r))
    return f'''__device__ __forceinline__ void wgmma_m64n{n}k16_ss(float (&d)[{r}], uint64_t desc_a, uint64_t desc_b, int scale_d) {{
    asm volatile("{{\\n.reg .pred p;\\nsetp.ne.b32 p, %{r+2}, 0;\\n"
                 "wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16 {{{regs}}}, %{r}, %{r+1}, p, 1, 1, 0, 0;\\n}}\\n"
                 : {outs}
                 : "l"(desc_a), "l"(desc_b), "r"(scale_d));
}}
'''
n = int(sys.argv[1])
t = (Path(__file__).resolve().parents[2] / 'steps/step14/kernel.cu').read_text()
t=t.replace('#include "wgmma.cuh"\n', '#include "wgmma.cuh"\n'+ss(n))
t=t.replace('constexpr int BLOCK_N = 128; ','constexpr int BLOCK_N = %d; '%n)
t=t.replace('wgmma_m64n128k16_ss(S,', f'wgmma_m64n{n}k16_ss(S,')
print(t)
