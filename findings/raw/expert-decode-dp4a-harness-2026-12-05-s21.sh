source tools/gpu-env.sh .whl-small >/dev/null 2>&1
for pass in 1 2; do
  for dec in vabsdiff4 dp4a; do
    python3 -c "
import runpy, sys
from remote_drafter.models import exl3_triton as t
if '$dec' == 'dp4a':
    t.ASM_VABSDIFF = t.ASM
sys.argv = ['exl3_moe_layer.py', '--out', '$OUT/exl3-moe-layer-$dec-$pass.json']
runpy.run_path('packages/remote-drafter/benchmarks/exl3_moe_layer.py', run_name='__main__')
" 2>&1 | grep '^{' | cut -c1-200 | sed "s/^/$dec $pass: /"
  done
done
